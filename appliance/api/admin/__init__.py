"""The operator's routes: the state document (and its schemas, the structs the console decodes), the
session list, one session's detail and release."""
