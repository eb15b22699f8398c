"""Stopping the meter: the provider's API call that ends a box's billing, run by ``rgt down``
once the run is off the box.

    api.py       one small client per provider (RunPod, vast.ai, Lambda, Paperspace) over urllib
    journal.py   $RGT_CONTROLLER_HOME/meter/NAME.json: intent, the one call, its outcome, polls
    stop.py      the step: show, call once, poll until gone; typed outcomes
"""
