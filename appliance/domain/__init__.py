"""Pure values of the appliance: stdlib only, no I/O, no clock."""
