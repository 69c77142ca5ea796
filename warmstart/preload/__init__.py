"""Starts without a new interpreter: a preloaded process that ``WARMSTART=1`` processes fork from.

A preloader (``warmstart preload start``) imports torch, TorchRec, torch's compiler and warmstart
once, for one user, interpreter and import-time environment. A process started with ``WARMSTART=1``
in that environment hands itself over from the interpreter's start-up hook, before it imports
anything: the preloader forks a child that runs the program, and the process forwards its signals
to it and ends as it ends. Nothing in the job or its launcher changes (docs/preload.md).

* :mod:`~warmstart.preload.control`: start, status and stop (``warmstart preload``);
* :mod:`~warmstart.preload.environment`: what must match, and where a preloader listens;
* :mod:`~warmstart.preload.client`: the handover, in the process (built-in modules only: every
  ``WARMSTART=1`` interpreter imports it, so this package imports nothing);
* :mod:`~warmstart.preload.server` and :mod:`~warmstart.preload.child`: the preloader, and a child
  becoming the program.
"""
