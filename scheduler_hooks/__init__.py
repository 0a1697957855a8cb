"""The serving layer: request types (io), sampling, the scheduler hooks, the scheduler, the Engine.

Import the pieces from their modules (``scheduler_hooks.engine.Engine``, ``scheduler_hooks.io``);
this package file stays empty of imports so that ``scheduler_hooks.io`` loads without torch models.
"""
