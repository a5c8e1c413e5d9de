"""The fixed reference text the accuracy gate scores (written for this project).

Plain expository English on mixed subjects, with a few numbers, a list and a short code
fragment, about 1,000 tokens for SmolLM2's tokenizer: long enough that one unlucky
token does not move the perplexity, short enough to score in seconds. Never change it
without rerunning `python -m loadtest.engine.accuracy`: the committed results quote it.
"""

from __future__ import annotations

REFERENCE_TEXT = """\
The lighthouse at the end of the harbour was built in 1874, when the town still lived \
from fishing and the coast was known for sudden fog. Its keeper climbed one hundred and \
twelve steps every evening to trim the wick and wind the clockwork that turned the lens. \
In winter the work was harder: salt froze on the glass, and the keeper had to scrape it \
off by hand before the light could reach the boats. When electricity came to the town in \
1931, the clockwork was replaced by a small motor, and the keeper's family moved into a \
house in the village. The tower is now a museum, and on clear days visitors can see the \
islands forty kilometres to the west.

Bread is one of the oldest prepared foods. A simple loaf needs only flour, water, salt \
and yeast, but the way these are combined changes everything. Warm water wakes the yeast \
quickly, while cold water slows it down and gives the dough time to develop flavour. \
Kneading stretches the gluten into long strands that trap the gas the yeast produces, so \
the loaf rises instead of spreading flat. Many bakers let the dough rest overnight in a \
cool room; the slow rise makes a crust that is darker and a crumb that is more open. The \
oven should be hot, around 230 degrees Celsius, and a tray of water on the lowest shelf \
keeps the surface soft long enough for the bread to expand.

A computer program is a list of instructions, but most of the difficulty lies in \
deciding what the instructions should be. Consider a function that returns the largest \
number in a list:

def largest(values):
    best = values[0]
    for value in values[1:]:
        if value > best:
            best = value
    return best

The function assumes the list is not empty. If it is, the first line fails with an \
error. A careful programmer either checks for this case and reports it clearly, or \
documents that the caller must never pass an empty list. Neither choice is always right; \
what matters is that the behaviour is written down and tested.

Rivers shape the land they cross. Over thousands of years a river cuts a valley, carries \
sand and stones downstream, and drops them where the water slows. Near the sea the \
current weakens, and the river spreads into many channels that form a delta. Farmers \
have settled on deltas since ancient times because the soil is rich and the water is \
close, but the same floods that bring new soil can also destroy houses and fields. \
Modern engineers build levees and reservoirs to control the flow, yet every dam also \
holds back the sediment that the delta needs, and many deltas are now slowly sinking.

There are three common ways to keep a garden healthy without chemicals:
1. Rotate the crops each year, so that pests which feed on one plant do not find it \
again in the same place.
2. Plant flowers such as marigolds between the vegetables to attract insects that eat \
aphids.
3. Cover the soil with straw or leaves, which keeps moisture in and weeds out.

The history of the bicycle is a story of small improvements. The first machines of the \
early nineteenth century had no pedals at all; riders pushed themselves along with their \
feet. Later designs put pedals on the front wheel, which was made very large so that one \
turn of the pedals would carry the rider a long way. These high wheelers were fast but \
dangerous, since a sudden stop could throw the rider over the handlebars. The safety \
bicycle, with two wheels of equal size and a chain driving the rear one, solved the \
problem in the 1880s, and its basic shape has changed little since then. Air-filled \
tyres, gears and lighter frames came later, each making the ride a little easier.

Sleep is not a passive state. During the night the brain passes through several cycles, \
each lasting about ninety minutes, in which deep sleep alternates with the lighter stage \
in which most dreams occur. Deep sleep helps the body repair tissue and strengthens the \
memory of facts learned during the day, while the dreaming stage seems to be important \
for skills and emotions. Adults who sleep less than six hours a night for long periods \
tend to react more slowly, make more mistakes and catch colds more often. A regular \
bedtime, a dark room and a break from bright screens before sleep are the simplest \
remedies, and they cost nothing.

When people first measured the speed of light, they used the moons of Jupiter. The \
moons seemed to run early when Jupiter was close to the Earth and late when it was far \
away, and the difference showed how long the light took to cross the extra distance. \
Later experiments used rotating mirrors and toothed wheels on mountaintops, and today \
the value is fixed by definition at 299,792,458 metres per second. The metre itself is \
now defined as the distance light travels in a small fraction of a second, so the two \
measurements are tied together forever.
"""
