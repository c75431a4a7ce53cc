"""drifttool.probes"""
