"""The main job: the reference TorchRec training job and the cold-vs-warm start benchmark.

``reference_job`` (entry point), ``trainer``, ``model``, ``data`` and ``config`` are the job, written
to be read as an example of warmstart in a training script; ``cold_vs_warm`` runs it as baseline,
cold and warm on fresh machines and compares them.
"""
