"""Adapters for environments and tasks of other libraries (docs/environments.md).

* :mod:`~verl_trainer.environments.gymnasium`: a gymnasium environment with text observations and actions
  as an :class:`~verl_trainer.agents.Environment`.
* :mod:`~verl_trainer.environments.openenv`: an OpenEnv environment (openenv-core's ``Environment``
  in process, or its HTTP / WebSocket client) as an :class:`~verl_trainer.agents.Environment`.
* :mod:`~verl_trainer.environments.reasoning_gym`: reasoning-gym tasks as ``reasoning_gym:<task>`` data
  paths, scored by the tasks' own verifiers.

Each module imports its library only when used (the ``envs`` extra).
"""
