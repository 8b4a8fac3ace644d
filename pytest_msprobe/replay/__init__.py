"""Replay: each recorded API call rebuilt from its dumped inputs and run again on the CPU in float64, so that the
call's own error (its dumped output against the replay of its own inputs) is known whatever flowed into it.

Imports torch; never pytest. Reads dumps through :mod:`pytest_msprobe.format`.
"""
