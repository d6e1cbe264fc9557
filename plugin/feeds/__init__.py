"""kvroute.plugin.feeds."""
