"""The controller: the training loop that drives the actor meshes."""
