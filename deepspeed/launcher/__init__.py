"""The ``deepspeed`` launcher.

``runner`` is the ``deepspeed`` / ``ds`` command: it reads the hostfile, picks the
resources, and starts one per-node launcher (``launch``) on every node, locally or
through pdsh / ssh / OpenMPI / MPICH / Slurm. ``launch`` spawns and supervises the
ranks of one node. Nothing is imported here so that ``python -m`` stays cheap.
"""
