"""kvroute.plugin.state."""
