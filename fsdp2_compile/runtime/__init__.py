"""What `shard` does to a module: sharded parameters, their state, the FSDP2 module API and eager behaviour."""
