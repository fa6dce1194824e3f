"""A model turn's way through the appliance, from the API's hand-over to its last record:
the turn desk that orders it (`turn_desk`), the turn's values (`turn`) and the task it names
(`turn_task`), where it goes (`placement`, over the queue book of what each worker was sent,
`queue_book`, and when each attempt ran, `attempt_spans`), the body it goes with
(`worker_body`) and the tokens it is hashed by when it went untokenised (`sent_tokens`), the
forwarder that runs one attempt (`forwarder`), the turns in flight a cancellation or a
deadline reaches (`flights`), and the ledger rows and metrics it leaves (`turn_records`)."""
