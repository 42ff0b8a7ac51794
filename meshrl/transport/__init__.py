"""Data channels between actor meshes: the versioned RDMA weight store (learner -> generators,
SDPO teacher) and the delayed-result channel (teacher replay actors -> controller)."""
