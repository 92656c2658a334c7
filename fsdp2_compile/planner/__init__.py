"""The simulator: a step traced on meta tensors, memory and step time predicted for a layout and a device."""
