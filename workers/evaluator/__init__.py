"""The evaluator (`jet worker eval`): held-out evaluation of published weight versions, off the training path.

`episodes` plays a task's held-out rows with the task's own workflow and reward on a backend in this
process (`LocalClient`); `worker` follows a model's versions and writes one row per evaluated version.
"""
