"""What the appliance is told and where it keeps it: the typed settings tree and its
sections (`settings`, `settings_api`, `settings_escalation`, `settings_section`), the
settings built from their sources (`settings_load`) and shown as YAML (`settings_yaml`),
the data directory (`datadir`) and the API keys kept in it (`keystore`)."""
