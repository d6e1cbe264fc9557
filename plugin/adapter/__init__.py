"""kvroute.plugin.adapter."""
