"""kvroute.plugin.cli."""
