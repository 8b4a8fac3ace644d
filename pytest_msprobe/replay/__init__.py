"""Replay: each recorded API call rebuilt from its dumped inputs and run again on the CPU in float64, so that the
call's own error (its dumped output against the replay of its own inputs) is known whatever flowed into it.

Offline (:mod:`.offline`, a tensor dump's files) and online (:mod:`pytest_msprobe.dump.online_self_check`, as the step
runs) share the same pieces: which function a name is (:mod:`.apis`, torch's own: :mod:`.pristine`), the run
and the judging of a call (:mod:`.backward`, :mod:`.offline`), the standard (:mod:`.standard`, computed by
:mod:`.figures`). Imports torch (but :mod:`.pristine`, until it captures); never pytest. Reads dumps through
:mod:`pytest_msprobe.format`.
"""
