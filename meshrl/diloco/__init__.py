"""DiLoCo across replicas over an object store: the outer optimizer (`outer`), the object-store
all-reduce (`allreduce` over `store`), the per-replica synchroniser (`sync`), rollout shards
(`shards`) and the executors that launch replicas (`executors`)."""
