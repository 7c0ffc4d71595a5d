"""Drafter training: warm-start, the DataBuffer and its producer, the online spot trainer, the
rank coordinator and the elastic spot pool."""
