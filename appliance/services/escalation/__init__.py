"""Escalation: turns sent to an outside endpoint instead of the local box (docs/escalation.md).

sides.py        which side a turn goes to (policy/escalation.py's rules) and each
                task's pin, so a task's turns stay on the side a header chose
outside_body.py what leaves the box: the model, messages, tools and sampling fields only
anthropic_out.py, anthropic_back.py
                the same turn for a Messages API endpoint, and its answer back as chat
relay.py        one attempt at an outside endpoint: its cap, its answer or stream, its
                ledger row (tokens as it reports them, cost at its prices)
service.py      the desk's one call: serve a turn on its side, back to the local box's
                admission when the outside attempt fails
"""
