"""Channel 3, N-teacher trace replay: frozen traces, canonicalisers, k-of-N agreement, the replay of
one trace against the teachers, and the controller-side channel that turns results into DPO data."""
