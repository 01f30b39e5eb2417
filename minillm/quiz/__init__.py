"""Rehearse the interview questions in questions/: `minillm quiz` in a terminal, `show(lab=...)` in a notebook.

    import minillm.quiz
    minillm.quiz.show(lab="lab02")        # the lab's questions, answers folded
    bank = minillm.quiz.load_bank()       # every question, validated

Importing this package stays light (PyYAML only; no torch).
"""
from minillm.quiz.bank import Bank, BankError, Question, load_bank
from minillm.quiz.show import render, show

__all__ = ["Bank", "BankError", "Question", "load_bank", "render", "show"]
