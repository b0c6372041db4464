"""Turning a job into units and running them: in this process, or on Ray."""
