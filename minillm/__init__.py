"""minillm"""
