"""kvroute.plugin.dev."""
