"""The pytest layer: the only modules of the package that import pytest (the plugin and the rank processes'
plugin). Everything they do is built from objects of the other layers."""
