"""What the forward pass costs the device: the HSTU block cached against full recompute, kernel launches."""
