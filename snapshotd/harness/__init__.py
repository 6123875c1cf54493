"""Real jobs on one machine, for the demo, the tests and the benchmarks: a local cluster of snapshotd daemons
(:mod:`.cluster`), rank processes started warm or cold (:mod:`.processes`), the training program they run
(:mod:`.trainer`, its model in :mod:`.workloads`, its disk checkpoints in :mod:`.checkpoints`) and the demo's story
(:mod:`.demo`). Nothing here imports the benchmarks; they import this."""
