"""`appliance profile`: this box measured with the served model, inside the
interpreter that has vLLM (`box_measure.py`, run as a script), and written as a GPU
profile (`box_profile.py`)."""
