"""Measuring one variant in the process that serves it: engines behind one protocol, the
request loop, a server started with the agent and the traffic sent to it, the probe and its
rows, and the environment a run was measured on."""
