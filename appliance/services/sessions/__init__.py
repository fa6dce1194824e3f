"""Agent sessions as the router knows them: the session table, per tenant, of the token ids
each session has sent (`sessions`), the token ids of a rendered chat (`chat_tokens`), what a
model's answer ended in (`answer_tools`), the session of a turn that names none
(`session_finder`) and each tenant's prefix-cache salt (`tenancy`)."""
