"""Getting a run onto a box: the preflight audit, code releases, the agent's wheel, installing
the agent, and ``rgt deploy`` itself (flow.py)."""
