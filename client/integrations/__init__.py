"""snapshotd in training frameworks, each an optional extra: :mod:`.huggingface` (the Hugging Face ``Trainer``,
``snapshotd[huggingface]``) and :mod:`.lightning` (``snapshotd[lightning]``)."""
