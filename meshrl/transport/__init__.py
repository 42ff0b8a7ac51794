"""Transport between actor meshes, knowing no roles: the versioned weight store (a publisher's
weight versions pulled by readers, over shared memory or RDMA) and delayed results (producers
send whenever a result is ready; the consumer drains without waiting)."""
