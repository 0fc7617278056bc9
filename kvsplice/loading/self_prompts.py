"""Short prompts across domains that ``kvsplice distill`` hands the source model to write its own fine-tuning text
(:mod:`kvsplice.loading.self_text`): varied openings so the continuations cover what the model does, not one domain.
Plain openings, no chat template; :data:`UNCONDITIONAL` marks a start from the tokenizer's separator alone."""

from __future__ import annotations

__all__ = ["PROMPTS", "UNCONDITIONAL", "prompt_list"]

UNCONDITIONAL = ""  # a start with no text: the separator token alone (or the first sampled token)

PROMPTS: dict[str, tuple[str, ...]] = {
    "science": (
        "Photosynthesis is the process by which", "The speed of light in a vacuum is",
        "Why is the sky blue? The short answer is", "In quantum mechanics, the uncertainty principle states",
        "The human heart has four chambers:", "Plate tectonics explains how", "A black hole forms when",
        "Enzymes speed up chemical reactions by", "The periodic table is organised so that",
        "Vaccines work by training the immune system to", "Climate scientists measure ocean temperature using",
        "DNA is made of four bases,", "Newton's second law says that", "The mitochondria produce energy by",
        "Volcanoes erupt because", "Sound travels faster in water than in air because",
        "The experiment was designed to test whether", "Bacteria and viruses differ in that",
        "Entropy is a measure of", "Honeybees communicate the location of flowers by",
        "The Hubble telescope observed", "Antibiotic resistance develops when",
        "Water boils at a lower temperature at high altitude because", "Neurons transmit signals by",
    ),
    "history": (
        "The Roman Empire reached its greatest extent under", "In 1492, Christopher Columbus",
        "The Industrial Revolution began in Britain because", "The printing press changed Europe by",
        "During the Cold War, the United States and the Soviet Union", "The ancient Egyptians built the pyramids",
        "The French Revolution of 1789", "The Silk Road connected", "The fall of the Berlin Wall in 1989",
        "Genghis Khan united the Mongol tribes and", "The Renaissance was a period of",
        "The American Civil War ended in", "Ancient Athens is often called the birthplace of democracy because",
        "The Black Death killed", "The Meiji Restoration transformed Japan by",
        "In the 19th century, railways", "The first human to walk on the Moon", "The Ottoman Empire controlled",
        "Historians still debate why the Maya cities were abandoned.", "The Magna Carta, signed in 1215,",
    ),
    "code": (
        "def fibonacci(n):\n", "import numpy as np\n\n", "# A function that reverses a linked list\n",
        "class Stack:\n    def __init__(self):\n",
        "SELECT name, COUNT(*) FROM orders", "#include <stdio.h>\n\nint main",
        "function debounce(fn, delay) {\n", "To install the package, run\n\n```bash\n", "git commit -m \"",
        "The difference between a list and a tuple in Python is", "Here is a Python script that reads a CSV file:\n",
        "// Binary search in a sorted array\n", "fn main() {\n    let", "public static void main(String[] args) {\n",
        "A hash table stores key-value pairs by", "The bug was caused by an off-by-one error in",
        "<!DOCTYPE html>\n<html>\n<head>\n", "def quicksort(arr):\n    \"\"\"",
        "#!/bin/bash\n# Back up the home folder\n",
        "Big-O notation describes", "The stack trace shows that", "In Git, a rebase differs from a merge because",
        "const express = require('express');\n", "Unit tests should", "Recursion is when a function",
    ),
    "instructions": (
        "How to make a cup of tea:\n1.", "Steps to change a flat tyre:\n", "To plant tomatoes, first",
        "Question: How do I reset my password?\nAnswer:", "Here are five tips for better sleep:\n",
        "Write a short email asking for a day off.\n\n", "Explain to a child how rain forms.\n\n",
        "Question: What should I pack for a weekend hike?\nAnswer:", "Recipe for pancakes\n\nIngredients:\n",
        "How to write a good cover letter:", "Summarise the following paragraph in one sentence.\n\n",
        "Translate into French: \"Where is the train station?\"\n", "Give three reasons to learn a second language.\n",
        "Instructions: assemble the shelf by", "To improve your running speed,",
        "Question: How do I boil an egg?\nAnswer:", "A checklist for moving house:\n-",
        "How to care for a houseplant:", "Explain the rules of chess briefly.\n", "Tips for a job interview:\n1.",
    ),
    "dialogue": (
        "\"Where have you been?\" she asked.", "User: Can you help me plan a trip to Italy?\nAssistant:",
        "A: Did you finish the report?\nB:", "Customer: My order hasn't arrived yet.\nAgent:",
        "Teacher: Who can tell me what a noun is?\nStudent:", "\"I don't think we should go in there,\" whispered",
        "Doctor: What brings you in today?\nPatient:", "Interviewer: Tell me about yourself.\nCandidate:",
        "User: What is the capital of Australia?\nAssistant:", "Mom: Did you clean your room?\nKid:",
        "\"We need to talk,\" he said, closing the door.", "Host: Welcome back to the show. Today our guest is",
        "User: Write a haiku about autumn.\nAssistant:", "Alice: I lost my keys again.\nBob:",
        "Reporter: What happened here this morning?\nWitness:", "Player 1: Let's trade wood for sheep.\nPlayer 2:",
    ),
    "news": (
        "BREAKING: A powerful earthquake struck", "The city council voted on Tuesday to",
        "Stock markets fell sharply after", "Scientists announced a new discovery that",
        "The government unveiled a plan to", "Local residents gathered to protest", "In sports news, the team",
        "Heavy rain caused flooding across", "The company reported record profits", "A new study published today",
        "Officials said the election results", "The national football team won", "Health authorities warned that",
        "The central bank raised interest rates", "A wildfire forced thousands of people to",
        "Tech giant announces", "The museum reopened after", "Weather forecast for the weekend:",
    ),
    "fiction": (
        "Once upon a time, in a small village,", "The door creaked open, and", "It was a dark and stormy night.",
        "The dragon had slept for a thousand years until", "She found the letter hidden under the floorboards.",
        "Captain Reyes stared at the strange planet below.", "On his tenth birthday, Tom received a mysterious box.",
        "The detective looked at the body and said", "Long ago, the sea and the sky were friends.",
        "The robot had never seen snow before.", "Every morning, the old baker", "The last train left at midnight,",
        "Lily and her dog Max went to the park.", "When the lights went out, everyone", "The map led them to",
        "In the year 2150, humans lived", "The king summoned his three daughters and", "A little bird sat on",
        "Nobody in town believed the old woman when she said", "The spaceship's alarm started beeping.",
        "He opened his eyes and did not recognise the room.", "The princess did not want to marry the prince.",
    ),
    "math": (
        "A train travels 60 miles per hour. How long does it take to travel 150 miles?",
        "Sarah has 12 apples. She gives 5 to her friend. How many", "Solve for x: 3x + 7 = 22.",
        "The area of a circle with radius 4 is", "If a shirt costs $25 and is on sale for 20% off,",
        "Problem: A rectangle has a perimeter of 30 cm and a length of 9 cm. Find its width.\nSolution:",
        "What is 15% of 240?", "The sum of the angles in a triangle is",
        "Prove that the square root of 2 is irrational.",
        "Tom is twice as old as his sister. In five years", "A recipe needs 3 cups of flour for 12 cookies. How much",
        "The derivative of x^2 is", "Let f(x) = 2x + 1. Then f(3) =",
        "There are 24 students in a class and 3/8 of them",
        "The probability of rolling a six on a fair die is", "Convert 5 kilometres to metres:",
        "A store sells pencils in packs of 8. If Maria needs 50 pencils,", "The prime numbers less than 30 are",
    ),
    "lists": (
        "Top 10 places to visit in Japan:\n1.", "Shopping list:\n- milk\n-", "The planets of the solar system are:",
        "Ten animals that live in the ocean:\n", "Things to do on a rainy day:\n1.",
        "Famous painters of the Renaissance:",
        "Common symptoms of the flu include", "The seven continents are", "Key features of the new phone:\n-",
        "Best books of the year:\n1.", "Ingredients for a vegetable soup:\n-", "Countries in South America:",
        "Benefits of regular exercise:\n1.", "Chapter 1: Introduction\nChapter 2:",
        "Pros and cons of working from home:\n",
    ),
    "reference": (
        "Paris is the capital and most populous city of", "The tiger (Panthera tigris) is",
        "Mount Everest is Earth's highest mountain above sea level,", "William Shakespeare was an English playwright",
        "The Amazon River flows through", "Basketball is a team sport in which", "The piano is a keyboard instrument",
        "Coffee is a beverage brewed from", "The Great Wall of China is", "Albert Einstein was a theoretical physicist",
        "Jupiter is the fifth planet from the Sun", "The violin, sometimes known as a fiddle,",
        "Tokyo is the capital of Japan and", "Chess is a board game for two players,", "The Nile is a major river in",
    ),
    "opinion": (
        "In my opinion, the best way to learn is", "I have always believed that", "Review: This restaurant",
        "Five stars. I bought this blender", "Dear editor, I am writing to complain about",
        "The movie was disappointing because", "Why I stopped using social media:",
        "Is it worth buying an electric car?",
        "Remote work is here to stay, and", "My favourite season is winter because", "Dear diary, today was",
        "Honestly, the new update", "As a parent, I worry that", "The hardest lesson I learned at my first job was",
    ),
    "business": (
        "Meeting notes, 14 March:\n-", "Our quarterly revenue increased by", "Dear Mr. Thompson,\n\nThank you for",
        "Job description: We are looking for", "Executive summary:", "The marketing strategy focuses on",
        "Terms and conditions: By using this service, you agree", "Subject: Project update\n\nHi team,",
        "Invoice #4521\nDate:", "To start a small business, you need", "Product description: This lightweight backpack",
        "Press release: The company today announced",
    ),
    "poetry_and_song": (
        "Roses are red,", "The wind whispers through the trees,", "I wandered lonely as a cloud",
        "Verse 1:\nWalking down the empty street,", "A haiku about the sea:\n", "Twinkle, twinkle, little star,",
        "Ode to the morning:", "Under the silver moon,",
    ),
    "everyday": (
        "Today I went to the market and", "The weather today is", "My grandmother's kitchen always smelled of",
        "The bus was late again, so", "After school, the children", "We decided to adopt a cat.",
        "The neighbours were having a party,", "It was the first day of summer holidays.", "I woke up at six and",
        "The football match on Saturday", "At the airport, the queue", "Our holiday by the lake",
    ),
}


def prompt_list(unconditional: int = 4) -> list[str]:
    """Every prompt once, domains interleaved (so a short corpus still spans them), then ``unconditional`` starts
    from nothing."""
    groups = list(PROMPTS.values())
    out = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    return out + [UNCONDITIONAL] * unconditional
