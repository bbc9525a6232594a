"""Expert placement. Serving time here: algorithm, local_search, location, recorder, metrics; offline tools in
tools/: synth, analyze, simulate, plan (`moeserve eplb`)."""
