"""The one training loop and what it measures: memory counters, fake-tensor predictions,
sharding, the replicas of a distributed run, checkpoints. Imports contract, storage and base."""
