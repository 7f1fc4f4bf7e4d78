"""`jet dash`: the live web dashboard (jet.dash.server) and the readers behind its pages.

A small room: one server module, static assets beside it (static/), and one
reader per page (swarm, training, episodes, studies) plus the Prometheus
exporter. It imports no torch; tokenizers load only to decode an episode.
"""
