"""snapshotd in training frameworks, each an optional extra: :mod:`.huggingface` (the Hugging Face ``Trainer``,
``snapshotd[huggingface]``), :mod:`.lightning` (``snapshotd[lightning]``) and :mod:`.torchtitan` (a checkpoint
manager for torchtitan's Trainer, ``snapshotd[torchtitan]``)."""
