"""Black-box agent programs trained through an OpenAI-compatible endpoint: request validation
(`requests`), the served calls of an episode and the trajectories assembled from them without
re-tokenising (`transcript`), the wire format (`wire`), the loopback HTTP server (`server`) and the
runs of the agent programs (`programs`). The rollout strategy that drives them is
meshrl.controller.agents."""
