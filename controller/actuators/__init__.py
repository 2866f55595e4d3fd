"""Actuators: how the controller's decisions reach processes, nodes and Kubernetes."""
