"""drifttool.sampling"""
