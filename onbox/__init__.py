"""Everything that runs on the GPU box: the agent (``rgt-agent``) and, later, the training API.

Never imports ``controller``. Modules here keep to Python 3.9.
"""
