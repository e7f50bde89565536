"""1-bit Adam, 0/1 Adam and 1-bit LAMB: optimizers that compress their own communication.

Parts:

* ``base.py``  - the communication backend choice (``comm_backend_name``), error-feedback
  buffers, the switch the training strategy reads (``gradient_allreduce_needed``) and the
  rank-local checkpoint state.
* ``adam.py``  - :class:`OnebitAdam` (config type ``OneBitAdam``).
* ``zoadam.py`` - :class:`ZeroOneAdam` (``ZeroOneAdam``): variance freezing and local steps.
* ``lamb.py``  - :class:`OnebitLamb` (``OneBitLamb``).
* ``config.py`` - validation of their ``optimizer.params`` and the factory the engine's
  optimizer builder (``runtime/optimizers.py``) calls.

The compressed all-reduce itself is :mod:`deepspeed.runtime.comm.compressed`. Users and
docs: ``docs/onebit.md``.
"""
