"""Data that never starves the device: tokenize once into records, then read, shuffle, pack and
prefetch with Grain, and place the next batches on the devices while the current step runs."""
