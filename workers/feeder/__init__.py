"""The feeder (`jet feed`, and inside `jet up`): keeps the task streams topped up from their datasets and
admits a trained model's episodes against its trainer's progress.

`feeder` is the role (topping up, admission, progress); `tasks` writes Task messages (also for `jet enqueue`).
"""
