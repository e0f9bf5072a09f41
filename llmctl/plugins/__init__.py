"""Plugins: pluggy hookspecs and the manager that finds plugins through entry points."""

from llmctl.plugins.hookspecs import hookimpl
from llmctl.plugins.manager import PluginFailure, PluginInfo, get_plugin_manager

__all__ = ["PluginFailure", "PluginInfo", "get_plugin_manager", "hookimpl"]
