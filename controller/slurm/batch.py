"""The batch script `rgt deploy --profile slurm` submits (placeholder: its owner fills it in).

``batch_script(...)`` returns the text of an sbatch script that runs ``rgt-agent run`` in the
foreground (exec'd, so the agent is the batch shell and gets ``--signal=B:USR2@LEAD``), with
``--requeue``, ``--open-mode=append`` and its output under the run directory.
"""
