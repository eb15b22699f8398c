"""Slurm: rgt's run inside a batch job submitted through the login node (sbatch, squeue,
scontrol, scancel over ssh), warned before its time limit, sealed, requeued and resumed."""
