"""Data channels between actor meshes: the versioned RDMA weight store (learner -> generators)."""
