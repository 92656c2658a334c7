"""The floor everything stands on: the custom ops (eager-correct, traceable) and the IR's typed views of them."""
